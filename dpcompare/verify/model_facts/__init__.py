"""Facts about the model, each measured and none assumed.

Owns: model_probe (what the model is, found before it is wrapped: unused, frozen, sparse, random), buffer_semantics
(which data-parallel semantics each buffer follows), batch_split (whether the ranks' split computes the global
batch's gradient), split_causes (why not, each cause tested), replica_forwards (which forwards stand for a step's
gradient), data_dependence (where the forward reads the data into Python). May import memory and everything below it;
not its siblings (diagnosis, trajectory, starting_state).
"""
