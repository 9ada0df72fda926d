"""modelplane's control plane: state, endpoint specs, the admin API and the CLI."""
