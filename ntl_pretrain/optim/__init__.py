"""The optimizer (`optimizer`: AdamW, run the way each placement runs it fastest) and the learning-rate schedule
(`schedule`)."""
