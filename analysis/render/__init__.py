"""A report's results as text, Markdown, JSON, CSV and HTML."""
