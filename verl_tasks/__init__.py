"""verl-tasks: RL post-training of language models as idempotent, fault-tolerant tasks.

Importing the package changes nothing in the process: Airflow's scheduler, DAG processor and
api-server import it too. What a library needs is set where that library is used (see
``verl_tasks.quiet`` for the command line's own process).
"""

__version__ = "0.1.0"
