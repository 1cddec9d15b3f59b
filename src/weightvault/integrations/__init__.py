"""Where training loops already checkpoint: callbacks that save into a vault."""
