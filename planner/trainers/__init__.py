"""Plans for the trainers people run: export a plan as a torchtitan, Megatron-LM or DeepSpeed configuration, and
read such a configuration back as the strategy it runs (`stratagem export`, `estimate --from`, `plan --baseline`)."""
