"""trainer package."""
