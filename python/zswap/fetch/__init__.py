"""The fetch layer: when params are gathered. The trace of a pass (`_trace`), the scheduler and its
prefetch (`prefetch`), reads ahead between passes (`_between`), the module hooks (`hooks`), the backward
output pool (`outputs`) and the fetch pool's sizing (`buffers`)."""
