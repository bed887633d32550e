//! Workspace integration and snapshot tests live in `tests/tests/`; this library is empty.
