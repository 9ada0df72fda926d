"""The data plane: the runtime inside each replica, and the router in front of them."""
