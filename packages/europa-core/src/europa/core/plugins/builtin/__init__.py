"""europa-core's default plugins: each is replaceable by an enabled technique plugin."""
