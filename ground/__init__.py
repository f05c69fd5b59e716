"""The ground floor: plumbing every stage shares (storage URIs and the local cache, hashing), importing no stage."""
