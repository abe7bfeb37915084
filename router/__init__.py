"""Router: the gRPC front door (tandem.v1.Generation), validation and routing."""
