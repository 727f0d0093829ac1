"""The gradients layer: partition gradients. Where they are kept between backward and the step
(`gradstore`: memory, NVMe, the stash) and how a param's gradient gets there (`grads`: sinks, norms,
`full_grad`)."""
