"""The backend's own spans: OTLP receiver and Triton span conversion (used by sampling)."""
