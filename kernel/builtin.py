"""Built-in defaults, registered through the same hooks as any plugin."""
