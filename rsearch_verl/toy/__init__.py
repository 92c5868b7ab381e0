"""The toy world wing: seeded, fictional worlds whose questions can only be answered by searching, with what exists
only for them -- their demonstrations, the tiny policy's tokenizer and the warm start (`model.sft_checkpoint=auto`).
Real-data preparation, dataset loading and question selection are rsearch_verl/data/.

    world.py       the default world (`data=toy_world`), its cache and CLI: `python -m rsearch_verl.toy.world`
    world_hard.py  the harder generator (`data=toy_world_hard`), which world.generate hands over to by its knobs
    entities.py    entities and fact phrasing the generators share
    demos.py       scripted search demonstrations over a world (SFT data, practice sides)
    tokenizer.py   a BPE tokenizer trained on a world for the tiny policy: `python -m rsearch_verl.toy.tokenizer`
    warm_start.py  the SFT curriculum checked by skill probes, cached: `python -m rsearch_verl.toy.warm_start`

A new world is a new module here (its generator, dispatched to from world.generate by the data.toy_world knobs it
reads) and a data group recipes/data/<name>.yaml that sets those knobs.
"""
