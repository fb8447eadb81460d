"""The ResNet example's image functions, shared by its tf.data and Grain input pipelines.

Training: Inception-style random-resized crop (Szegedy et al. 2015, "Going
Deeper with Convolutions"; the crop of the TF/Flax/MLPerf ResNet references:
area 8%..100% of the image, aspect ratio 3/4..4/3, 10 attempts, then a center
crop) resized to ``image_size`` and a random horizontal flip, from a stateless
seed per example. Evaluation: center crop of ``crop_fraction`` (224/256 = 0.875
for ImageNet) of the shorter side, resized to ``image_size``. Images stay uint8;
:func:`normalize` runs on the device inside the train and eval steps.
"""

from __future__ import annotations

import dataclasses
from typing import Any

# ImageNet channel means and standard deviations on the 0..255 scale (the Flax
# ImageNet example, torchvision, MLPerf).
MEAN_RGB = (0.485 * 255, 0.456 * 255, 0.406 * 255)
STDDEV_RGB = (0.229 * 255, 0.224 * 255, 0.225 * 255)


def normalize(images: Any, dtype: Any = None) -> Any:
  """On-device normalisation of uint8 images: ``(x - mean) / std`` per channel.

  Args:
    images: uint8 ``[..., 3]`` (a ``jax.Array``).
    dtype: output dtype (default float32; bfloat16 for bf16 compute).

  Returns:
    ``[..., 3]`` array of ``dtype``.
  """
  import jax.numpy as jnp  # the pipeline itself is TF-only

  x = images.astype(jnp.float32)
  x = (x - jnp.asarray(MEAN_RGB, jnp.float32)) / jnp.asarray(STDDEV_RGB, jnp.float32)
  return x.astype(dtype or jnp.float32)


@dataclasses.dataclass(frozen=True)
class Preprocessing:
  """How images become ``[image_size, image_size, 3]`` uint8 tensors.

  Attributes:
    image_size: output height and width S in pixels (224 for ImageNet).
    random_resized_crop: train with the Inception-style random crop (False:
      train on the whole image resized, as for the 8x8 digits).
    area_range: fraction of the image area a random crop covers (Inception:
      0.08..1.0).
    aspect_ratio_range: width / height of a random crop (Inception: 3/4..4/3).
    flip: random horizontal flip in training (not for digits).
    crop_fraction: eval center crop as a fraction of the shorter side
      (0.875 = 224 / (224 + 32), the Flax/TF ImageNet examples).
    resize_method: ``tf.image.resize`` method (bicubic in the Flax example).
  """

  image_size: int = 224
  random_resized_crop: bool = True
  area_range: tuple[float, float] = (0.08, 1.0)
  aspect_ratio_range: tuple[float, float] = (3 / 4, 4 / 3)
  flip: bool = True
  crop_fraction: float = 0.875
  resize_method: str = "bicubic"


# -- TF image functions (traced by tf.data) ------------------------------------


def _image_shape(image_bytes):
  """Height, width, channels of encoded image bytes (int32 ``[3]``)."""
  import tensorflow as tf

  return tf.cond(
      tf.io.is_jpeg(image_bytes),
      lambda: tf.io.extract_jpeg_shape(image_bytes, output_type=tf.int32),
      lambda: tf.shape(tf.io.decode_image(image_bytes, channels=3, expand_animations=False),
                       out_type=tf.int32))


def _decode_and_crop(image_bytes, window):
  """Decodes the ``window = [y, x, h, w]`` crop of encoded bytes to uint8 ``[h, w, 3]``."""
  import tensorflow as tf

  def jpeg():
    return tf.io.decode_and_crop_jpeg(image_bytes, window, channels=3)

  def other():
    image = tf.io.decode_image(image_bytes, channels=3, expand_animations=False)
    return image[window[0]:window[0] + window[2], window[1]:window[1] + window[3], :]

  image = tf.cond(tf.io.is_jpeg(image_bytes), jpeg, other)
  image.set_shape([None, None, 3])
  return image


def _center_window(shape, crop_fraction: float):
  import tensorflow as tf

  h, w = shape[0], shape[1]
  size = tf.cast(crop_fraction * tf.cast(tf.minimum(h, w), tf.float32), tf.int32)
  size = tf.maximum(size, 1)
  return tf.stack([(h - size + 1) // 2, (w - size + 1) // 2, size, size])


def _random_window(shape, seed, p: Preprocessing):
  """Inception-style crop window; the center crop when 10 attempts fail."""
  import tensorflow as tf

  bbox = tf.constant([0.0, 0.0, 1.0, 1.0], tf.float32, shape=[1, 1, 4])
  begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
      shape, bounding_boxes=bbox, seed=seed, min_object_covered=0.1,
      aspect_ratio_range=p.aspect_ratio_range, area_range=p.area_range, max_attempts=10,
      use_image_if_no_bounding_boxes=True)
  window = tf.stack([begin[0], begin[1], size[0], size[1]])
  # sample_distorted_bounding_box returns the whole image when every attempt
  # failed; the references then take the eval center crop instead.
  failed = tf.logical_and(tf.equal(size[0], shape[0]), tf.equal(size[1], shape[1]))
  return tf.cond(failed, lambda: _center_window(shape, p.crop_fraction), lambda: window)


def _resize_uint8(image, p: Preprocessing):
  import tensorflow as tf

  image = tf.image.resize(image, [p.image_size, p.image_size], method=p.resize_method)
  return tf.cast(tf.clip_by_value(tf.round(image), 0.0, 255.0), tf.uint8)


def preprocess_train(image_bytes, seed, p: Preprocessing):
  """Training crop + flip of one encoded image.

  Args:
    image_bytes: scalar ``tf.string``, the encoded image (JPEG or PNG).
    seed: int32/int64 ``[2]`` stateless seed of this example.
    p: the preprocessing settings.

  Returns:
    uint8 ``[S, S, 3]``.
  """
  import tensorflow as tf

  crop_seed, flip_seed = tf.unstack(tf.random.experimental.stateless_split(seed, 2))
  shape = _image_shape(image_bytes)
  if p.random_resized_crop:
    window = _random_window(shape, crop_seed, p)
  else:
    window = tf.stack([0, 0, shape[0], shape[1]])
  image = _resize_uint8(_decode_and_crop(image_bytes, window), p)
  if p.flip:
    image = tf.image.stateless_random_flip_left_right(image, flip_seed)
  return image


def preprocess_eval(image_bytes, p: Preprocessing):
  """Eval center crop of one encoded image: uint8 ``[S, S, 3]``."""
  window = _center_window(_image_shape(image_bytes), p.crop_fraction)
  return _resize_uint8(_decode_and_crop(image_bytes, window), p)
