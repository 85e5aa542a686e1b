"""`mtpserve bench`: the deployment's tuning experiment as one command. `workload.py` sends and measures
chat requests, `runner.py` starts a server per configuration (or uses one at a URL) and interleaves
rounds, `report.py` writes the tables, JSON and plots. Talks HTTP only: it measures mtpserve and
llama-server the same way."""
