"""The analyses (XSP A1-A15 and more), one stateless module per level or concept; each takes a
`Frames` (`analyses.common`) and returns a DataFrame."""
