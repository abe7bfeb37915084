"""tandem.v1: generated from protos/tandem/v1/*.proto. Do not edit: run scripts/gen_protos."""
