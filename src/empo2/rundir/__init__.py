"""The run folder: checkpoints and their checksums, resume, the run lock, metrics and trackers, storage faults,
export."""
