"""Where shard bytes come from: local maps, object storage, the node-local cache."""
