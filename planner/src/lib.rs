//! Lifetime planner (being written).
