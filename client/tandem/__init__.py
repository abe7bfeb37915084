"""Generated code of the Tandem wire contract (protos/tandem/). Do not edit: run scripts/gen_protos."""
