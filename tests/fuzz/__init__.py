"""Coverage-guided fuzz targets (atheris): each feeds the same bytes to a C parser of the relay
and to its Python reference and fails on any difference. See docs/testing.md."""
