"""Quality analysis: the surrogate (Lambda) against measured degradation."""
