"""Twenty JSON schemas for the structured-output proof and benchmark: nested objects, arrays,
enums, bounded numbers and required fields, each small enough that a valid answer fits in a
couple of hundred tokens (strings and arrays carry bounds)."""

from __future__ import annotations

from typing import Any

_NAME = {"type": "string", "minLength": 1, "maxLength": 16}
_TEXT = {"type": "string", "maxLength": 32}

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {"type": "object", "properties": {
        "name": _NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"], "additionalProperties": False},
    "point": {"type": "object", "properties": {
        "x": {"type": "number", "minimum": -10, "maximum": 10},
        "y": {"type": "number", "minimum": -10, "maximum": 10}},
        "required": ["x", "y"], "additionalProperties": False},
    "color": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "shade": {"enum": ["light", "dark"]}},
        "required": ["color"], "additionalProperties": False},
    "tags": {"type": "object", "properties": {
        "tags": {"type": "array", "items": _NAME, "minItems": 1, "maxItems": 4}},
        "required": ["tags"], "additionalProperties": False},
    "address": {"type": "object", "properties": {
        "street": _TEXT, "city": _NAME,
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "required": ["city", "zip"], "additionalProperties": False},
    "order": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 99999},
        "items": {"type": "array", "maxItems": 3, "items": {
            "type": "object", "properties": {
                "sku": _NAME, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["sku", "qty"], "additionalProperties": False}},
        "paid": {"type": "boolean"}},
        "required": ["id", "items", "paid"], "additionalProperties": False},
    "weather": {"type": "object", "properties": {
        "city": _NAME, "celsius": {"type": "number", "minimum": -50, "maximum": 60},
        "sky": {"enum": ["clear", "cloudy", "rain", "snow"]}},
        "required": ["city", "celsius", "sky"], "additionalProperties": False},
    "rating": {"type": "object", "properties": {
        "stars": {"type": "integer", "minimum": 1, "maximum": 5}, "comment": _TEXT},
        "required": ["stars"], "additionalProperties": False},
    "matrix": {"type": "object", "properties": {
        "rows": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "array", "minItems": 1, "maxItems": 3,
            "items": {"type": "integer", "minimum": 0, "maximum": 9}}}},
        "required": ["rows"], "additionalProperties": False},
    "book": {"type": "object", "properties": {
        "title": _TEXT, "author": {"type": "object", "properties": {
            "first": _NAME, "last": _NAME}, "required": ["last"],
            "additionalProperties": False},
        "year": {"type": "integer", "minimum": 1450, "maximum": 2030}},
        "required": ["title", "author", "year"], "additionalProperties": False},
    "flag": {"type": "object", "properties": {"enabled": {"type": "boolean"}},
             "required": ["enabled"], "additionalProperties": False},
    "range": {"type": "object", "properties": {
        "low": {"type": "integer", "minimum": -100, "maximum": 0},
        "high": {"type": "integer", "minimum": 1, "maximum": 100}},
        "required": ["low", "high"], "additionalProperties": False},
    "status": {"type": "object", "properties": {
        "code": {"enum": [200, 404, 500]}, "message": _TEXT},
        "required": ["code", "message"], "additionalProperties": False},
    "contact": {"type": "object", "properties": {
        "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.(com|org)$"},
        "phones": {"type": "array", "maxItems": 2,
                   "items": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"}}},
        "required": ["email"], "additionalProperties": False},
    "event": {"type": "object", "properties": {
        "name": _NAME, "day": {"type": "integer", "minimum": 1, "maximum": 31},
        "month": {"enum": ["jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep",
                           "oct", "nov", "dec"]}},
        "required": ["name", "day", "month"], "additionalProperties": False},
    "scores": {"type": "object", "properties": {
        "scores": {"type": "array", "minItems": 2, "maxItems": 5,
                   "items": {"type": "number", "minimum": 0, "maximum": 1}}},
        "required": ["scores"], "additionalProperties": False},
    "tree": {"type": "object", "properties": {
        "value": {"type": "integer", "minimum": 0, "maximum": 9},
        "children": {"type": "array", "maxItems": 2, "items": {
            "type": "object", "properties": {
                "value": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["value"], "additionalProperties": False}}},
        "required": ["value", "children"], "additionalProperties": False},
    "product": {"type": "object", "properties": {
        "name": _NAME, "price": {"type": "number", "minimum": 0, "maximum": 1000},
        "currency": {"enum": ["USD", "EUR", "JPY"]},
        "in_stock": {"type": "boolean"}},
        "required": ["name", "price", "currency", "in_stock"], "additionalProperties": False},
    "answer": {"type": "object", "properties": {
        "answer": {"enum": ["yes", "no", "maybe"]},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["answer", "confidence"], "additionalProperties": False},
    "config": {"type": "object", "properties": {
        "server": {"type": "object", "properties": {
            "host": _NAME, "port": {"type": "integer", "minimum": 1, "maximum": 65535}},
            "required": ["host", "port"], "additionalProperties": False},
        "debug": {"type": "boolean"},
        "level": {"enum": ["info", "warn", "error"]}},
        "required": ["server", "level"], "additionalProperties": False},
}
