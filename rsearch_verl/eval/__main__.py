"""`python -m rsearch_verl.eval`: evaluate a checkpoint with search and print the EM / F1 table
(see rsearch_verl/eval/evaluate.py)."""

from rsearch_verl.eval.evaluate import main
from rsearch_verl.log_setup import setup_logging

if __name__ == "__main__":
    setup_logging()
    main()
