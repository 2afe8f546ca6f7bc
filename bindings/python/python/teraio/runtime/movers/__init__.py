"""The tiers bytes move to and from (pinned host memory, the store) and the copies between them
and the GPU."""
