"""The local Ray runtime env passes the driver's Hugging Face offline settings on, and forces none of them.

.venv/bin/python -m pytest -q tests/trainer/test_trainer_worker_env.py
"""

from rsearch_verl.trainer.session import worker_env_vars


def test_offline_flags_follow_the_driver():
    # a driver without the flags: the workers get none either (a hub model the driver can load, they can load)
    assert worker_env_vars({"PATH": "/bin"}) == {"TOKENIZERS_PARALLELISM": "false"}
    offline = worker_env_vars({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    assert offline == {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    assert worker_env_vars({"HF_HUB_OFFLINE": "0"})["HF_HUB_OFFLINE"] == "0"
    assert worker_env_vars({"TOKENIZERS_PARALLELISM": "true"})["TOKENIZERS_PARALLELISM"] == "true"
