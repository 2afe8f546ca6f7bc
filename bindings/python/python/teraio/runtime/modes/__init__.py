"""The modes: each one's policy (what to move, keep or recompute, and when)."""
