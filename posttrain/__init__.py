"""posttrain package."""
