"""The fetch layer: when params are gathered. The trace of a pass (`_trace`), the scheduler and its
prefetch (`prefetch`), the next-pass cache (`nextpass`: reads ahead and seeds), the module hooks
(`hooks`), the backward output pool (`outputs`) and the fetch pool's sizing (`buffers`)."""
