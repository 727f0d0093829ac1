"""The build layer: building and converting models. `Init` and its patches (`init`), the module API
on partitioned models (`module_api`: deepcopy, dtype casts, resize) and transformers' loading under
Init (`_hf`)."""
