//! Every bad input and every device failure gives a clear error and loses nothing.
