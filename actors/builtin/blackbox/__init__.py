"""Black-box agents: any program that speaks the OpenAI API, with turn recovery (docs/blackbox.md)."""
