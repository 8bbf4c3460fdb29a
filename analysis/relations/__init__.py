"""The relations built once per set of traces over the loaded kernel and layer spans (layer
calls, layers, kernels), and the SQL that takes trimmed means over them."""
