"""What a run reports while it runs: the console lines (`console`), `metrics.jsonl`, W&B and MFU (`metrics`), and a
profile of a window of steps (`profiling`)."""
