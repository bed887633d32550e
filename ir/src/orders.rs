//! Pipeline orders: the built-in schedules' action lists and the well-formedness check of any
//! order (parallel spec §1 "Schedules" and §3.4). Filled in by the language work of issue 26.
