//! Property test: random put/get/delete/reopen sequences match an in-memory model.
