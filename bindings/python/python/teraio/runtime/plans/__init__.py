"""Plans as typed objects: the tensor plan's, the block planner (pure), whole-model capacity."""
