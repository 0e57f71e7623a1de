"""Pull-based weight transfer (docs/internals.md §6): the trainer publishes each policy version once; every
instance pulls it when it is ready, from peers that already hold it, falling back to the store.

Trainer::

    publisher = WeightPublisher(config, redis_client, run_id, run_dir=run_dir)
    publisher.publish(version, model.state_dict())   # host copy, then background work
    publisher.close()

Rollout instance::

    puller = WeightPuller(config, redis_client, run_id, instance_id, run_dir=run_dir)
    state_dict = puller.pull(version)                # complete and verified, or PullError
    puller.close()

`latest` is a Redis key and a pub/sub channel (`holders.latest_version`, `holders.weights_channel`).

Modules, one job each:

* `config`      `WeightsConfig`, the settings both sides share;
* `manifest`    a version as a manifest plus safetensors byte chunks (encode, verify, decode);
* `store`       the fsspec object store: chunks first, manifest last; list, read, delete;
* `retention`   which store versions to delete (pure policy);
* `holders`     Redis state: latest, manifest digests, holders, pull leases (with TTLs);
* `auth`        HMAC request signatures with the shared secret;
* `admission`   bounded concurrent uploads per server, earliest puller first;
* `bandwidth`   an emulated uplink cap (benchmarks on one machine);
* `peer_server` the HTTP server (starlette + uvicorn) serving versions held in memory;
* `peer_client` signed GETs against peer servers (keep-alive, timeouts, error classes);
* `publisher`   the trainer side;
* `puller`      the instance side;
* `instance`    a standalone pulling-and-serving process (tests, benchmark);
* `model_source` the base model's copy under the weight store (upload once, fetch and cache).

The package imports none of them, so `infra.weights.config` loads without torch.
"""
