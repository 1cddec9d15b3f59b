"""One safetensors file: its header and manifest, the save plan, the writer and the reader."""
