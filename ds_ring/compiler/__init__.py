"""``torch.compile`` support: ds_ring's attention as custom ops the compiler holds whole."""
