"""The step layer: updating params and optimizer state. The offloaded optimizer (`optim/`), the update in
backward (`earlystep`), the step at the boundary with clipping and loss scaling (`stepping`,
`loss_scale`) and the learning-rate schedules (`schedules`)."""
