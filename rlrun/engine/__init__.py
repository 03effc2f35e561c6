"""Engines: where the model lives and how its optimizer steps. `single` is one process, one device."""
