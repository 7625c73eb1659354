"""Twenty pydantic models for the structured-output tests: nested objects, arrays, enums, optional
fields, bounded numbers. Strings and arrays carry bounds, as a schema for a small model should."""

from __future__ import annotations

import enum
from typing import Literal, Optional

from pydantic import BaseModel, Field


class Color(str, enum.Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Priority(int, enum.Enum):
    low = 1
    high = 2


class Point(BaseModel):
    x: int
    y: int


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=150)


class Flag(BaseModel):
    enabled: bool


class Money(BaseModel):
    amount: float = Field(ge=0, le=1_000_000)
    currency: Literal["USD", "EUR", "JPY"]


class Paint(BaseModel):
    color: Color
    coats: int = Field(ge=1, le=5)


class Polyline(BaseModel):
    points: list[Point] = Field(max_length=4)


class Team(BaseModel):
    lead: Person
    members: list[Person] = Field(max_length=3)


class Task(BaseModel):
    title: str = Field(max_length=30)
    priority: Priority
    done: bool
    due: Optional[str] = Field(default=None, max_length=10)


class Rating(BaseModel):
    stars: int = Field(ge=1, le=5)
    score: float = Field(gt=0, lt=1)


class Tags(BaseModel):
    tags: list[Literal["python", "rust", "go"]] = Field(min_length=1, max_length=3)


class Address(BaseModel):
    street: str = Field(max_length=25)
    city: str = Field(max_length=15)
    zip: str = Field(pattern=r"^[0-9]{5}$")


class Customer(BaseModel):
    person: Person
    address: Address
    vip: bool


class Matrix(BaseModel):
    rows: list[list[int]] = Field(max_length=3)


class Settings(BaseModel):
    theme: Color
    font_size: int = Field(ge=8, le=32)
    beta: Optional[Flag] = None


class Order(BaseModel):
    id: int = Field(ge=1)
    total: Money
    lines: list[Task] = Field(max_length=2)


class Measurement(BaseModel):
    sensor: Literal["a", "b"]
    value: float = Field(ge=-40, le=125)
    ok: Optional[bool] = None


class Tree(BaseModel):
    label: str = Field(max_length=8)
    left: Optional[Point] = None
    right: Optional[Point] = None


class Survey(BaseModel):
    answers: list[Rating] = Field(max_length=3)
    comment: Optional[str] = Field(default=None, max_length=40)
    colors: list[Color] = Field(max_length=2)


class Event(BaseModel):
    kind: Literal["start", "stop"]
    at: int = Field(ge=0, le=86_400)
    priority: Optional[Priority] = None


class Timeline(BaseModel):
    events: list[Event] = Field(min_length=1, max_length=3)
    closed: bool


MODELS = [Point, Person, Flag, Money, Paint, Polyline, Team, Task, Rating, Tags, Address, Customer, Matrix,
          Settings, Order, Measurement, Tree, Survey, Event, Timeline]
