"""OCI images without a Docker engine: layers, image layout, registry client, embedded registry."""
