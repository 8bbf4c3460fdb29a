"""Trace records built in code: `synthetic` (one trace of any size, W3C-shaped ids), the
report's scenarios (`report_scenarios`, what scripts/make_report_testdata.py writes under
tests/data/) and `memory.InMemoryTraceStore` (the trace store's interface in memory)."""
