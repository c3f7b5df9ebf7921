"""Data parallelism: replicas of the whole engine as Ray actors behind the one HTTP front end,
each request routed to the replica holding the longest prefix of its prompt."""

ROUTINGS = ("prefix", "round-robin")  # --data-parallel-routing's choices (router.py)
