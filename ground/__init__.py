"""The ground floor: plumbing every stage shares (storage, cache, hashing, config overrides, logging, the process
group view, metrics plumbing, the GPU table), importing no stage. See ground/README.md."""
