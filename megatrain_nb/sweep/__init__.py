"""The causal-LM registry sweep: tiny configs, the parity check, the table."""
