"""Offline analyses of xsp-sidecar trace stores (XSP A1-A15 and more); see `report.py`."""
