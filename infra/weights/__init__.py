"""Pull-based weight transfer (docs/internals.md §6): the trainer publishes each policy version once
(most as sparse deltas on the version before); every instance pulls it when it is ready, from peers
that hold it or part of it, falling back to the store.

    publisher = WeightPublisher(config, redis_client, run_id, run_dir=run_dir)    # the trainer
    publisher.publish(version, model.state_dict())   # host copy, then background work
    publisher.close()

    puller = WeightPuller(config, redis_client, run_id, instance_id, run_dir=run_dir)   # an instance
    state_dict = puller.pull(version)                # complete and verified, or PullError
    puller.close()

`latest` is a Redis key and a pub/sub channel (`holders.latest_version`, `holders.weights_channel`).
The package imports none of its modules, so `infra.weights.config` loads without torch; each
module's job: docs/internals.md §6.
"""
