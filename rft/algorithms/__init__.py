"""algorithms package."""
