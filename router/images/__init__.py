"""Image inputs on the router (docs/images.md): the limits and URL options (`config.py`), the
checkpoint's vision spec and the processor's resize rule (`vision.py`), decoding and hashing in a
worker thread (`decode.py`), data: URLs and the optional http(s) fetch (`fetch.py`), and one
request's images prepared and expanded into its prompt, with the counters (`prepare.py`).

Life of an image: a chat part, a Responses `input_image` or a gRPC ImagePart becomes an ImageRef
naming where it was; `Images.prepare` gets its bytes, decodes it off the event loop (limits first,
then the first frame as RGB), hashes the pixels and computes its grid; once the prompt is
tokenized, `Images.expand` replaces its one <|image_pad|> by the image's tokens and records the
offset; the resulting ImageInputs go to the node that prefills the prompt."""
